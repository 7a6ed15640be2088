"""What a newcomer does first: the README's set-up commands, importing from a source checkout, the benchmarks."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    # -P is not used: like `python -c` typed in a shell, the current directory comes first on sys.path.
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_the_readme_test_command_is_what_ci_runs():
    main_job, tests = readme_commands()[:2]
    assert "hybridjit generate" in main_job and "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()
    # Neither relies on a bare `python3.12` (a pyenv shim that fails without PYENV_VERSION).
    assert all("bash .ci/find-python" in c for c in (main_job, tests))


def test_find_python_prints_a_python_312():
    path = subprocess.run(["bash", ".ci/find-python"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    version = subprocess.run([path.strip(), "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("Python 3.12")


def test_the_source_tree_imports_from_the_repository_root():
    out = run_python(
        "import hybridjit, hybridjit.models.deepseek_v3 as m, hybridjit.ops.routed_experts as ops;"
        "print(hybridjit.__file__); print(m.__file__); print(hybridjit.kernel_info()['kernel'])",
        ROOT,
    )
    assert out.returncode == 0, out.stderr
    package, model, kernel = out.stdout.split()
    assert Path(package).resolve().is_relative_to(ROOT) and Path(model).resolve().is_relative_to(ROOT)
    assert kernel in ("generic", "avx2", "avx512", "amx")


def test_import_hybridjit_starts_no_jax_and_exports_the_readme_names():
    out = run_python(
        "import sys, hybridjit; assert 'jax' not in sys.modules, 'jax imported';"
        "assert callable(hybridjit.load) and callable(hybridjit.kernel_info) and hybridjit.Model;"
        "print(hybridjit.__version__)",
        ROOT,
    )
    assert out.returncode == 0, out.stderr


def test_benchmarks_import_with_the_package_dependencies_alone():
    """Every bench/ script imports after `pip install .`: the test and training extras are blocked here."""
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    out = run_python(
        "import sys; sys.modules.update(optax=None, pytest=None);"  # None in sys.modules makes import fail
        f"import importlib; [importlib.import_module(s) for s in {scripts!r}]",
        ROOT / "bench",
    )
    assert out.returncode == 0, out.stderr
