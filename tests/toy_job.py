"""A toy job for torchrun-level tests: producer -> relay -> sink, optionally failing on purpose."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tidal.channels.channel import Channel  # noqa: E402
from tidal.channels.kinds import Kind  # noqa: E402
from tidal.controller.graph import Graph  # noqa: E402
from tidal.controller.job import run_job  # noqa: E402
from tests.toy import Item, Producer, Relay, Sink  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--fail", choices=["producer", "relay", "sink", "none"], default="none")
p.add_argument("--output-dir", required=True)
args = p.parse_args()
graph = Graph([Producer(fail_at_step=1 if args.fail == "producer" else None),
               Relay(fail_at_step=1 if args.fail == "relay" else None), Sink()],
              [Channel("items", "producer", "relay", Kind.SCATTER, Item),
               Channel("back", "relay", "sink", Kind.GATHER, Item)])
try:
    run_job(graph, steps=3, seed=0, output_dir=args.output_dir, timeout_s=600)
except ValueError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
