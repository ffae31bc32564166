"""The `cephalo` command. Each subcommand lives in `cephalo.commands.<name>` with
`add_arguments(parser)` and `run(args) -> int`, imported only when used (so `cephalo crd`
never imports torch)."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from cephalo.errors import CephaloError, Terminated

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("cephalo.commands.run", "run a CephaloJob on this machine (profile, plan, train)"),
    "plan": ("cephalo.commands.plan", "solve a plan for a model on a set of GPUs (--cluster: "
                                      "on the cluster's free GPUs, as the operator would)"),
    "crd": ("cephalo.commands.crd", "print the CephaloJob CustomResourceDefinition"),
    "export": ("cephalo.commands.export", "write a checkpoint as a plain PyTorch state_dict "
                                           "or a Hugging Face checkpoint (--format hf)"),
    "tokenize": ("cephalo.commands.tokenize",
                 "turn text (txt, jsonl, parquet, arrow) into a token file for data.tokenFile"),
    # On a cluster (kubeconfig): a thin layer over cephalo.client.
    "submit": ("cephalo.commands.submit",
               "validate and create a CephaloJob on the cluster; --watch follows it"),
    "status": ("cephalo.commands.status", "jobs on the cluster as a table, or one job in full"),
    "watch": ("cephalo.commands.watch",
              "follow a job: progress, ETA, phase changes; exit 0 Succeeded, 1 Failed"),
    "logs": ("cephalo.commands.logs", "a job's rank (and profiler) logs, prefixed by rank"),
    "suspend": ("cephalo.commands.lifecycle", "suspend a job (its pods go, checkpoints stay)"),
    "resume": ("cephalo.commands.lifecycle", "resume a suspended job from its checkpoint"),
    "delete": ("cephalo.commands.lifecycle", "delete a job and everything it made"),
}


class UserError(CephaloError):
    """A mistake in the user's input: printed as one line, exit code 2."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cephalo")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser(load: list[str] | None = None,
                 commands: dict[str, argparse.ArgumentParser] | None = None,
                 prog: str = "cephalo") -> argparse.ArgumentParser:
    """The `cephalo` parser (subcommands' arguments only for those in `load`, default all);
    `commands`, when given, receives each subcommand's parser."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Train transformers on mixed-GPU clusters.")
    parser.add_argument("--version", action="version", version=f"cephalo {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load is None or name in load:
            importlib.import_module(module).add_arguments(p)
        if commands is not None:
            commands[name] = p
    return parser


def _parse(argv: list[str], prog: str) -> argparse.Namespace:
    """The arguments; an unknown option is reported by its subcommand, with that command's
    usage (argparse leaves it to the top-level parser: `cephalo: error`, `cephalo` usage)."""
    wanted = [a for a in argv if a in COMMANDS][:1]
    commands: dict[str, argparse.ArgumentParser] = {}
    args, unknown = build_parser(wanted or None, commands, prog).parse_known_args(argv)
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _terminate(_signum: int, _frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None, prog: str = "cephalo") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv, prog)
    module = importlib.import_module(COMMANDS[args.command][0])
    # SIGTERM ends the command like Ctrl-C (its cleanup runs, exit 143); the caller's own
    # handler is back afterwards: main() called in-process (tests, a notebook) left its
    # handler behind, and a pytest told to stop with SIGTERM went on running.
    previous = signal.signal(signal.SIGTERM, _terminate) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        return int(module.run(args) or 0)
    except CephaloError as err:  # the user's mistake: one line, no traceback
        print(f"{prog} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{prog} {args.command}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `cephalo status | head`: the reader left, nothing to report
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (Python flushes stdout at exit)
        return 141
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def kubectl_main() -> int:
    """`kubectl cephalo ...`: kubectl runs the `kubectl-cephalo` on PATH with the words after
    `cephalo` (and its own environment: KUBECONFIG); usage and errors name the command as the
    user typed it."""
    return main(prog="kubectl cephalo")


if __name__ == "__main__":
    raise SystemExit(main())
