"""Finds a checkpoint directory for a model name, a Hugging Face repo id, or a path.

No downloads: a name resolves to weights already on disk, in the models directory ($HYBRIDJIT_MODELS,
default ~/.cache/hybridjit/models) or in the Hugging Face hub cache. When nothing is found the error lists
every place that was searched and how to put the weights there. An argument written as a path (./x, /x,
~/x, ...) is never looked up as a name.
"""

import os
from importlib import resources
from pathlib import Path

from hybridjit.gguf_file import is_gguf
from hybridjit.models.registry import NAMES as ALIASES


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_dir() -> Path:
    """The small model embedded in the package, used when no model is named."""
    return Path(str(resources.files("hybridjit") / "data" / "default"))


def cache_dir() -> Path:
    """Where hybridjit keeps what it measures once per machine ($HYBRIDJIT_CACHE, default ~/.cache/hybridjit)."""
    return Path(os.environ.get("HYBRIDJIT_CACHE", Path.home() / ".cache" / "hybridjit"))


def models_dir() -> Path:
    return Path(os.environ.get("HYBRIDJIT_MODELS", cache_dir() / "models"))


def hub_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return hf_home / "hub"


def _hub_snapshot(repo_id: str) -> tuple[Path | None, Path]:
    """The snapshot of repo_id in the hub cache (refs/main first, else the newest complete one)."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if (snapshot / "config.json").is_file():
            return snapshot, repo
    snapshots = sorted(
        (s for s in (repo / "snapshots").glob("*") if (s / "config.json").is_file()),
        key=lambda s: s.stat().st_mtime,
    )
    return (snapshots[-1] if snapshots else None), repo


def _is_name(text: str) -> bool:
    """Whether an argument is a bare name or an org/name repo id, the two things that are looked up.

    Anything else is written as a path (`/...`, `./...`, `../...`, `~...`, `.`, `..`, `a/b/c`, `dir/`) and
    means that path only: a typo must not find a model of that name, nor be suggested for download. A name
    ending in .gguf is a file, where it stands (`model.gguf` as `./model.gguf`).
    """
    parts = text.split("/")
    return (len(parts) <= 2 and not {"", os.curdir, os.pardir} & set(parts) and not text.startswith("~")
            and not is_gguf(text))


def resolve_model(name_or_path: str | os.PathLike | None) -> Path:
    """The checkpoint directory of a path (a directory, or text written as a path, or an os.PathLike), a
    known name, a repo id or a name in the models directory; None is the embedded model."""
    if name_or_path is None:
        return default_model_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir() or not (isinstance(name_or_path, str) and _is_name(name_or_path)):
        return _checkpoint_dir(path, shown=os.path.expanduser(name_or_path))
    name = str(name_or_path)
    repo_id = ALIASES.get(name.lower(), name if "/" in name else None)
    candidates = [models_dir() / name]
    if repo_id:
        more = (models_dir() / repo_id.split("/")[-1], models_dir() / repo_id)
        candidates += [c for c in more if c not in candidates]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    searched = [str(c) for c in candidates]
    if repo_id:
        snapshot, repo = _hub_snapshot(repo_id)
        if snapshot is not None:
            return snapshot
        searched.append(f"{repo}/snapshots/*")
    hint = (
        f"download it, e.g. `huggingface-cli download {repo_id} --local-dir {models_dir() / repo_id.split('/')[-1]}`,"
        if repo_id
        else "put a Hugging Face checkpoint directory (config.json, *.safetensors) there,"
    )
    raise ModelNotFoundError(
        f"no checkpoint for {name!r}. Looked in: {'; '.join(searched)}. To provide it, {hint} "
        f"set HYBRIDJIT_MODELS to the directory that holds it, or pass the checkpoint's path. "
        f"Known names: {', '.join(ALIASES)}."
    )


def _checkpoint_dir(path: Path, shown: str) -> Path:
    if path.is_file() and is_gguf(path):
        return path
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise ModelNotFoundError(
            f"{shown} {state}: a checkpoint is a directory with config.json and *.safetensors, or a .gguf file"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{shown} is a directory but has no config.json: not a checkpoint")
    return path
