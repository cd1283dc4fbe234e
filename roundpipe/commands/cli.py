"""The `roundpipe` command: a thin router to each subsystem's own `main(argv)`.

Every subcommand lives in the module that owns the concept (the doctor in
roundpipe.commands.doctor, benchmarks in roundpipe.bench, ...) and exposes
`main(argv: list[str] | None) -> int`.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "doctor": ("roundpipe.commands.doctor", "check the installation: versions, native core, SIMD, GPUs, Triton"),
    "train": ("roundpipe.commands.train", "train the built-in default model (no downloads)"),
    "bench": ("roundpipe.bench", "microbenchmarks: `roundpipe bench --list`"),
    "plan": ("roundpipe.commands.plan", "ask the planner: `roundpipe plan max-seq-len` (longest context under a cap), "
                                        "`roundpipe plan max-resolution` (largest image / clip of a diffusion transformer)"),
    "simulate": ("roundpipe.sim.cli", "simulate pipeline schedules and report bubbles"),
    "timeline": ("roundpipe.sim.timeline", "draw a simulated or recorded trace as a PNG"),
}


def usage() -> str:
    lines = ["usage: roundpipe <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`roundpipe <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from roundpipe import __version__

        print(f"roundpipe {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"roundpipe: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"roundpipe: command {name!r} is not part of this build ({module_name} is missing)", file=sys.stderr)
        return 2
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
