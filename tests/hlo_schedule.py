"""The execution order of a compiled XLA program, read from its scheduled HLO text.

Instructions of the entry computation are listed in schedule order; `call` instructions (on GPU, the
command buffers XLA records as CUDA graphs) are expanded in place, so the order holds across them.
"""

import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_CALLEE = re.compile(r" call\(.*to_apply=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_ATTRIBUTES = re.compile(r"backend_config=\{([^}]*)\}")
_ATTRIBUTE = re.compile(r"(\w+) = (-?\d+) : i64")


def computations(hlo_text: str) -> tuple[str, dict[str, list[str]]]:
    """(entry name, {computation name: its instruction lines})."""
    bodies, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            bodies[current].append(line)
    return entry, bodies


def schedule(hlo_text: str) -> list[dict]:
    """The executed instructions in order: each {'target': custom-call target or None, 'op_name': ...,
    'attributes': the custom call's integer attributes, 'in': the chain of called computations it sits in
    (e.g. a command buffer)}."""
    entry, bodies = computations(hlo_text)
    order = []

    def walk(name, chain):
        for line in bodies[name]:
            if (m := _CALLEE.search(line)) and m.group(1) in bodies:
                walk(m.group(1), (*chain, m.group(1)))
                continue
            target, op_name, attributes = _TARGET.search(line), _OP_NAME.search(line), _ATTRIBUTES.search(line)
            order.append({
                "target": target.group(1) if target else None,
                "op_name": op_name.group(1) if op_name else "",
                "attributes": {k: int(v) for k, v in _ATTRIBUTE.findall(attributes.group(1))} if attributes else {},
                "in": chain,
            })

    walk(entry, ())
    return order


def positions(order: list[dict], *, target: str | None = None, op_name: str | None = None) -> list[int]:
    return [
        i for i, ins in enumerate(order)
        if (target is None or ins["target"] == target) and (op_name is None or op_name in ins["op_name"])
    ]
