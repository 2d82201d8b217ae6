"""What is alive at a measured step's peak: the blocks of a CUDA allocator snapshot, largest first.

``memory_estimate --measure --snapshot PREFIX`` (best with ``--no-cudagraphs``: a CUDA graph's pool
is allocated once, at capture) writes one allocator snapshot per measured row, holding the history of
the last step. This replays that history: allocations and completed frees in order, the peak the
step reached over what was live before it, and the blocks live at that moment, each with the line
that allocated it (the Inductor-generated code's buffer, or our code's) from the stack the allocator
recorded. Reading it says which buffers make a peak, where the estimate (``memory_estimate``) says
what the graph should hold.

    python -m spmd.tools.peak_blocks /tmp/s.fully_shard_memory_budget=0.7.pickle --top 30
"""

from __future__ import annotations

import argparse
import linecache
import pickle
from dataclasses import dataclass, field

MiB, GiB = 2**20, 2**30
# source files whose lines say what a block is: Inductor's generated code, spmd, torch's FSDP
_TELLING = ("torchinductor", "/spmd/", "/tools/", "torch/distributed/fsdp")


@dataclass
class Peak:
    """The peak of a snapshot's traced history: bytes over what was live before it, and the blocks live then
    (size, the frames that allocated it); ``before``: bytes still allocated when the snapshot was taken."""

    peak: int
    blocks: list[tuple[int, list[dict]]] = field(default_factory=list)
    before: int = 0


def replay(snapshot: dict, device: int = 0) -> Peak:
    """Replay ``snapshot``'s trace for ``device`` (``torch.cuda.memory._snapshot()``'s dict)."""
    live: dict[int, tuple[int, list]] = {}
    current, best = 0, Peak(0)
    for event in snapshot["device_traces"][device]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            current += event["size"]
            if current > best.peak:
                best = Peak(current, sorted(live.values(), key=lambda b: -b[0]))
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    best.before = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    return best


def allocated_at(frames: list[dict], depth: int = 2) -> str:
    """The first ``depth`` telling frames of a block's stack, with their source lines."""
    out = []
    for f in frames:
        if any(t in f["filename"] for t in _TELLING):
            text = linecache.getline(f["filename"], f["line"]).strip()[:110]
            out.append(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']} | {text}")
            if len(out) == depth:
                break
    if out:
        return " <- ".join(out)
    return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['name']}" if frames else "?"


def report(peak: Peak, top: int) -> str:
    lines = [f"peak of the traced step: {peak.peak / GiB:.3f} GiB over what was live before it "
             f"({peak.before / GiB:.3f} GiB still allocated when the snapshot was taken)"]
    lines += [f"{size / MiB:9.1f} MiB  {allocated_at(frames)}" for size, frames in peak.blocks[:top]]
    lines.append(f"{len(peak.blocks)} blocks live at the peak, {sum(s for s, _ in peak.blocks) / GiB:.3f} GiB")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshots", nargs="+", help="allocator snapshot pickles (memory_estimate --snapshot)")
    p.add_argument("--top", type=int, default=30, help="largest blocks to list (default 30)")
    a = p.parse_args(argv)
    for path in a.snapshots:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        print(f"== {path}\n{report(replay(snapshot), a.top)}")


if __name__ == "__main__":
    main()
