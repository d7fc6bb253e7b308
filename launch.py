"""torchrun --nproc-per-node N launch.py --algo grpo [--config FILE] [--set key=value ...]"""
import sys

from tidal.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
