"""The image's Dockerfile, checked without a container runtime: it parses with BuildKit's own parser (the
``dockerfile`` package wraps moby/buildkit's Go parser), every instruction is one the Dockerfile reference defines,
every COPY/ADD source exists in the build context (the repository root, as deploy/k8s/README.md builds it) and passes
its .dockerignore, and the entry point is a console script of the wheel (pyproject.toml ``[project.scripts]``) whose
module the image installs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import dockerfile
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "k8s" / "Dockerfile"

#: Every instruction of the Dockerfile reference (docs.docker.com/reference/dockerfile/, "Overview"), upper case
#: as the parser reports them.
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def _ignored(source: str, ignore_lines: list[str]) -> bool:
    """Whether the build context leaves ``source`` out: the file excludes everything (``*``) and lets named paths
    back in with ``!path`` or ``!path/`` (the only form the image's .dockerignore uses; a bare ``*`` is required)."""
    if "*" not in ignore_lines:
        return False
    return f"!{source}" not in ignore_lines and f"!{source.rstrip('/')}/" not in ignore_lines


def dockerfile_problems(path: Path, context: Path, scripts: dict[str, str], packages: list[str]) -> list[str]:
    """What is wrong with the Dockerfile at ``path`` built from ``context``, one line each (empty: nothing).

    ``scripts``: pyproject's console scripts (name -> "module:function"); ``packages``: the top-level packages the
    wheel holds. Raises dockerfile.GoParseError when BuildKit's parser rejects the file."""
    commands = dockerfile.parse_file(str(path))
    ignore_path = path.with_name(path.name + ".dockerignore")
    ignore = ignore_path.read_text().split() if ignore_path.is_file() else []
    problems = [f"line {c.start_line}: unknown instruction {c.cmd}" for c in commands if c.cmd not in INSTRUCTIONS]
    if not commands or commands[0].cmd not in ("FROM", "ARG"):
        problems.append("the first instruction is not FROM (or ARG)")
    for c in commands:
        if c.cmd not in ("COPY", "ADD") or any(f.startswith("--from=") for f in c.flags):
            continue
        if len(c.value) < 2:
            problems.append(f"line {c.start_line}: {c.cmd} needs a source and a destination")
        for source in c.value[:-1]:
            if not (context / source).exists():
                problems.append(f"line {c.start_line}: {c.cmd} source {source} is not in the repository")
            elif _ignored(source, ignore):
                problems.append(f"line {c.start_line}: {c.cmd} source {source} is left out by {ignore_path.name}")
    entry = [c for c in commands if c.cmd == "ENTRYPOINT"]
    if not entry:
        return [*problems, "no ENTRYPOINT"]
    last = entry[-1]
    if not last.json:  # shell form runs `/bin/sh -c`, which gets SIGTERM instead of the program
        problems.append(f"line {last.start_line}: ENTRYPOINT is not in exec (JSON) form")
    program = last.value[0] if last.value else ""
    if program not in scripts:
        problems.append(f"line {last.start_line}: ENTRYPOINT {program!r} is not a console script of the wheel "
                        f"({', '.join(sorted(scripts))})")
    elif scripts[program].split(".")[0] not in packages:
        problems.append(f"ENTRYPOINT {program!r} runs {scripts[program]}, outside the packages the image installs")
    return problems


def _project() -> tuple[dict[str, str], list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    return project["project"]["scripts"], packages


def test_the_dockerfile_parses_copies_what_exists_and_enters_a_console_script_of_the_wheel():
    """deploy/k8s/Dockerfile: BuildKit's parser reads it, every COPY source is in the repository and in the build
    context, the ENTRYPOINT (exec form) is `skylb`, a console script of pyproject's that the installed distribution
    declares and that loads, and CMD (exec form) gives it `--help`."""
    import importlib.metadata

    from skylb.cli import main

    scripts, packages = _project()
    assert dockerfile_problems(DOCKERFILE, ROOT, scripts, packages) == []
    commands = dockerfile.parse_file(str(DOCKERFILE))
    [entry] = [c for c in commands if c.cmd == "ENTRYPOINT"]
    [cmd] = [c for c in commands if c.cmd == "CMD"]
    assert entry.value == ("skylb",) and cmd.json and cmd.value == ("--help",)
    [script] = [e for e in importlib.metadata.distribution("skylb").entry_points
                if e.group == "console_scripts" and e.name == entry.value[0]]
    assert script.load() is main


def test_the_check_finds_a_missing_source_a_shell_entrypoint_and_an_unknown_script(tmp_path):
    """The same check on broken files: a COPY of a path not in the context, one left out by the .dockerignore, an
    unknown instruction, a shell-form ENTRYPOINT naming no console script; and a file BuildKit cannot parse."""
    (tmp_path / "app").mkdir()
    (tmp_path / "secret").mkdir()
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:3.11-slim\nCOPY app missing ./\nCOPY secret ./\nFETCH x\nENTRYPOINT skylbx\n")
    (tmp_path / "Dockerfile.dockerignore").write_text("*\n!app/\n!missing\n")
    problems = dockerfile_problems(broken, tmp_path, {"skylb": "skylb.cli:main"}, ["skylb"])
    assert len(problems) == 5, problems
    assert any("missing is not in the repository" in p for p in problems)
    assert any("secret is left out" in p for p in problems)
    assert any("unknown instruction FETCH" in p for p in problems)
    assert any("exec (JSON) form" in p for p in problems) and any("'skylbx'" in p for p in problems)
    broken.write_text("FROM python:3.11-slim\nCOPY <<EOF /x\n")
    with pytest.raises(dockerfile.GoParseError):
        dockerfile_problems(broken, tmp_path, {}, [])
