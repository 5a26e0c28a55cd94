"""docs/reference/cli.md from the `elastune` command's argparse parsers (tools/docs_gen.py writes it).

The parsers are read from the source tree (the folders of pyproject's ``packages.find.where`` put on
sys.path), not from an installed copy, so the page never depends on what is installed. Commands that the
benchmarks package adds through the ``elastune.commands`` entry points are read from the modules those
entry points name in pyproject.toml: each exposes ``build_parser()`` beside its ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"

#: `python -m` entry points that are not `elastune` subcommands: (module, what it runs). Each module must
#: exist in the source tree (checked), so a moved module fails `docs_gen.py --check` instead of the page
#: silently naming it.
MODULE_COMMANDS: tuple[tuple[str, str], ...] = (
    ("elastune_worker.engine", "the serving engine alone (no Redis, no tuning), like `vllm serve`"),
    ("elastune_bench.sim.routing", "the gateway's routing policies in the trace-driven simulator"),
    ("elastune_ssjf.build", "build (or find cached) SSJF's output-length predictor; prints its figures"),
    ("elastune_ssjf", "the SSJF predictor service: `POST /v1/predict_length`, `/healthz`"),
    ("elastune_demo.build", "build the demo tiny GPT-2 (`--arch llama`: the tiny Llama) into the cache"),
    ("elastune_demo.adapters", "build the demo tiny Llama's LoRA adapters (ranks 8-64) into the cache"),
)


def _pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text())


def _source_on_path(project: dict[str, Any]) -> list[str]:
    where = project["tool"]["setuptools"]["packages"]["find"]["where"]
    return [str(ROOT / w) for w in where]


def _module_file(module: str, folders: list[str]) -> Path | None:
    rel = Path(*module.split("."))
    for folder in folders:
        for candidate in (Path(folder) / rel / "__main__.py", Path(folder) / rel.with_suffix(".py")):
            if candidate.is_file():
                return candidate
    return None


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    shown = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{shown}`"
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    )
    return f"`{shown} {metavar}`"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        default = action.default
        shown = "" if default is None or default is False or default == argparse.SUPPRESS else f"`{default}`"
        required = "required; " if action.required and action.option_strings else ""
        rows.append(f"| {_flags(action)} | {shown} | {_cell(required + (action.help or ''))} |")
    if not rows:
        return ["No options."]
    return ["| option | default | what it does |", "|---|---|---|", *rows]


def _subparsers(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return dict(action.choices), helps
    return {}, {}


def cli_reference(generated_header: str) -> str:
    project = _pyproject()
    folders = _source_on_path(project)
    sys.path[:0] = [f for f in folders if f not in sys.path]
    from elastune_cli import dataplane
    from elastune_cli.main import build_parser

    external = project["project"]["entry-points"]["elastune.commands"]
    parser = build_parser()
    commands, helps = _subparsers(parser)
    out = [
        generated_header,
        "# Commands\n",
        "Every `elastune` subcommand with its options, read from the command's own parsers "
        f"(`cli/elastune_cli/`). `elastune --version` prints the installed version; "
        "`elastune COMMAND --help` prints what this page shows for one command. "
        f"{', '.join(f'`{n}`' for n in external)} come from the benchmarks package "
        "(`bench/elastune_bench/`), "
        "which the `elastune` command never imports: it finds them through the `elastune.commands` entry "
        "points (pyproject.toml) and says what to install when that package is missing.\n",
        "| command | what it does |",
        "|---|---|",
    ]
    out += [f"| [`elastune {name}`](#elastune-{name}) | {_cell(helps[name])} |" for name in commands]
    for name, sub in commands.items():
        out.append(f"\n## elastune {name}\n")
        out.append(_cell(sub.description or helps[name]) + "\n")
        if name in dataplane.COMMANDS:
            out.append(
                f"Runs in its own interpreter; every argument after `{name}` goes to that program's parser: "
                f"`elastune {name} --help` lists them.\n"
            )
            continue
        if name in external:
            module = importlib.import_module(external[name].partition(":")[0])
            out.append(f"Provided by `{module.__name__}` (entry point `{name}`).\n")
            sub = module.build_parser()
        benches, bench_helps = _subparsers(sub)
        if not benches:
            out += _options(sub)
        else:  # `elastune bench`: a listing; each benchmark parses its own flags
            out += ["| benchmark | what it measures |", "|---|---|"]
            out += [f"| `elastune bench {b}` | {_cell(bench_helps[b])} |" for b in benches]
            out.append("\nEach benchmark has its own flags: `elastune bench NAME --help`.")
        if sub.epilog:
            out.append("\n" + _cell(sub.epilog))
    out += ["\n## Other commands (`python -m`)\n", "| command | what it runs |", "|---|---|"]
    for module, what in MODULE_COMMANDS:
        if _module_file(module, folders) is None:
            raise SystemExit(f"tools/cli_reference.py names {module}, which the source tree lacks")
        out.append(f"| `python -m {module}` | {_cell(what)} |")
    return "\n".join(out) + "\n"
