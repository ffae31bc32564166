"""Peak host memory of loading a Hugging Face checkpoint (issue 14): each rank reading only its
uneven shard ranges (`cephalo.trainer.hf_weights.HfReader`, what `model.pretrained` does)
against loading the full state_dict (`safetensors.torch.load_file` of every file, what a
loader without range reads does before it can take its shard).

A random Llama-shaped checkpoint (default ~110 M parameters, 0.44 GB in fp32, sharded into
~100 MB files with an index) is written once; every measurement then runs in a fresh
subprocess and reports its peak RSS (VmHWM, which counts the memory-mapped file pages a read
touched; reset after imports) above the RSS it had then. The sharded rank allocates its fp32
master shards and fills them in place from the checkpoint (what `init_from_pretrained` does
once the engine exists), so its peak is its shard plus the reader's transient. Bound
checked: peak <= (its shard + the largest unit buffer) x 1.1.

Run: python bench/hf_loading.py [--layers 8] [--hidden 768] [--ratios 0.5,0.3,0.2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cephalo.api.models import ModelConfig

MIB = 2**20


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(family="llama", num_layers=args.layers, hidden_size=args.hidden,
                       num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128,
                       ffn_hidden_size=args.ffn, vocab_size=args.vocab, sequence_length=256)


def write_checkpoint(config: ModelConfig, folder: Path, shard_bytes: int) -> None:
    """Random weights under the Hugging Face names, sharded like save_pretrained."""
    import torch
    from safetensors.torch import save_file

    from cephalo.api.hf_config import to_hf_config
    from cephalo.trainer.flat import param_specs
    from cephalo.trainer.hf_weights import unit_sources
    from cephalo.trainer.models import build_unit

    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for i in range(config.num_units):
        with torch.device("meta"):
            specs = param_specs(build_unit(config, i))
        for spec in specs:
            nbytes = spec.numel * 4
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][unit_sources(config, i)[spec.name].names[0]] = torch.randn(spec.shape)
            size += nbytes
    weight_map = {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(to_hf_config(config)))


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak() -> float:
    """Current RSS, with the peak (VmHWM) reset to it. Not ru_maxrss: that survives exec,
    so a child would inherit this parent's high-water mark."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def measure(mode: str, folder: str, config_json: str, ratios: list[float], rank: int) -> dict:
    """Runs in the child: peak RSS above the post-import baseline, in MiB."""
    import torch
    from safetensors.torch import load_file

    from cephalo.trainer.flat import FlatUnit
    from cephalo.trainer.hf_weights import HfReader
    from cephalo.trainer.models import build_unit

    config = ModelConfig.model_validate_json(config_json)
    with torch.device("meta"):  # the layout only: no memory
        units = [FlatUnit(i, build_unit(config, i), ratios, rank) for i in range(config.num_units)]
    shard_mib = sum(u.shard_numel for u in units) * 4 / MIB
    unit_mib = max(u.numel for u in units) * 4 / MIB
    baseline = _reset_peak()
    if mode == "sharded":
        # the engine's fp32 master shards (written, so their pages are really there), then
        # filled in place from the checkpoint as init_from_pretrained does
        masters = [torch.empty(u.shard_numel).fill_(0.5) for u in units]
        reader = HfReader(folder, config, tied=False)
        for i, u in enumerate(units):
            reader.read(i, u.specs, u.start, u.end, out=masters[i])
        assert all(bool(m.ne(0.5).any()) for m in masters if m.numel())
    else:
        # load_file maps the files lazily: clone, as loading into a model's parameters does
        state: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            state.update({k: t.clone() for k, t in load_file(str(path)).items()})
        assert len(state) == sum(len(u.specs) for u in units)
    return {"mode": mode, "rank": rank, "peak_mib": _status_mib("VmHWM") - baseline,
            "shard_mib": shard_mib, "unit_mib": unit_mib}


def _child(mode: str, folder: Path, config: ModelConfig, ratios: list[float], rank: int) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from hf_loading import measure; "
            "print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4], "
            "json.loads(sys.argv[5]), int(sys.argv[6]))))")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(Path(__file__).parent), mode,
                          str(folder), config.model_dump_json(), json.dumps(ratios), str(rank)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ratios", default="0.5,0.3,0.2")
    parser.add_argument("--shard-mb", type=int, default=100)
    args = parser.parse_args()
    config = _config(args)
    ratios = [float(r) for r in args.ratios.split(",")]
    with tempfile.TemporaryDirectory(prefix="cephalo-hf-bench-") as tmp:
        folder = Path(tmp) / "model"
        write_checkpoint(config, folder, args.shard_mb * 10**6)
        total_mib = config.total_parameters() * 4 / MIB
        print(f"checkpoint: {config.total_parameters() / 1e6:.1f} M parameters, "
              f"{total_mib:.0f} MiB fp32, {len(list(folder.glob('*.safetensors')))} files; "
              f"ratios {ratios}")
        full = _child("full", folder, config, ratios, 0)
        print(f"full state_dict          peak {full['peak_mib']:7.1f} MiB")
        ok = True
        for rank in range(len(ratios)):
            r = _child("sharded", folder, config, ratios, rank)
            bound = (r["shard_mib"] + r["unit_mib"]) * 1.1
            ok &= r["peak_mib"] <= bound
            print(f"rank {rank} ranges (r={ratios[rank]:.2f})  peak {r['peak_mib']:7.1f} MiB  "
                  f"(shard {r['shard_mib']:.1f} + largest unit {r['unit_mib']:.1f} MiB; "
                  f"bound x1.1 = {bound:.1f}) {'ok' if r['peak_mib'] <= bound else 'OVER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
