"""The model a benchmark runs: a real checkpoint, or random weights of a real geometry (hybridjit.synthetic),
loaded through the engine's own loader and expert bank either way."""

import argparse
import time

from hybridjit import engine
from hybridjit.checkpoint import Checkpoint
from hybridjit.models.registry import config_from_json
from hybridjit.placement import Placement
from hybridjit.resolve import resolve_model
from hybridjit.synthetic import GEOMETRIES, SyntheticCheckpoint, geometry_config
from hybridjit.weights import WeightLoader


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="checkpoint path or model name")
    source.add_argument("--geometry", choices=sorted(GEOMETRIES))
    parser.add_argument("--layers", type=int, help="truncate a geometry to this many layers")


def load_model(args, placement: Placement, weight_format: str, synthetic=SyntheticCheckpoint):
    """(the Model, its name, the config at full depth); a geometry is random `weight_format` weights made by
    `synthetic` (a SyntheticCheckpoint class), truncated to --layers."""
    if args.checkpoint:
        path = resolve_model(args.checkpoint)
        cfg = full = config_from_json(path / "config.json")
        ckpt, name = Checkpoint(path), str(path)
    else:
        cfg = geometry_config(args.geometry, layers=args.layers, weight_format=weight_format)
        full = geometry_config(args.geometry, weight_format=weight_format)
        ckpt, name = synthetic(cfg), args.geometry
    start = time.perf_counter()
    loader = WeightLoader(cfg, ckpt, placement)
    weights, expert_layers = loader.load()
    if not args.checkpoint:  # named by the routed experts' format as loaded (gpt-oss's stay MXFP4 whatever the rest)
        name += f" ({expert_layers[0].format if expert_layers else weight_format}, random weights)"
    print(f"loaded {name}, {cfg.num_hidden_layers} of {full.num_hidden_layers} layers, in "
          f"{time.perf_counter() - start:.1f} s")
    return engine.Model(ckpt.directory, cfg, weights, expert_layers, None, placement, loader), name, full
