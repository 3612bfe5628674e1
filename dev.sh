#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs a job.
#   bash dev.sh demo   -> set up, then run the multi-process CPU demo
#   bash dev.sh test   -> set up, then lint and run the whole test suite
#   bash dev.sh compat -> the integration tests against the oldest and newest lightning and fastai allowed
#   bash dev.sh gpu    -> on a machine with a GPU: the CUDA tests and the CUDA benchmark, with its own torch
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.ranksafe-setup

setup() {
  local want
  want=$(cat pyproject.toml requirements/*.txt dev.sh | sha256sum | cut -d' ' -f1)
  if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then return; fi
  echo "== setting up $VENV"
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  # CPU torch first, pinned to the CPU build: plain "torch==2.13.0" from PyPI is the CUDA build (gigabytes).
  if ! "${pip[@]}" "torch==2.13.0+cpu"; then
    echo "torch 2.13.0+cpu not found: point pip at PyTorch's CPU wheels and run again:" >&2
    echo "  PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash dev.sh $*" >&2
    exit 1
  fi
  # fastai without torchvision (see requirements/fastai-deps.txt); pip would warn that fastai wants it.
  "${pip[@]}" --no-deps "fastai==2.8.12"
  "${pip[@]}" --no-warn-conflicts -r requirements/fastai-deps.txt -r requirements/dev.txt -r requirements/docs.txt \
    -e ".[lightning,dev]" "torch==2.13.0"
  if "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
    echo "torchvision must not be installed (breaks lightning on CPU torch)" >&2; exit 1
  fi
  echo "$want" > "$STAMP"
}

job=${1:-}
case "$job" in
  demo)
    setup "$@"
    exec "$VENV/bin/ranksafe" demo "${@:2}" ;;
  test)
    setup "$@"
    export PATH="$PWD/$VENV/bin:$PATH"
    ruff check src tests nbs chaos benchmarks docs/_ext
    ruff format --check src tests nbs chaos benchmarks docs/_ext
    site=$(mktemp -d)
    executed=$(mktemp -d)
    trap 'rm -rf "$site" "$executed"' EXIT
    # pytest exits 5 when it collected nothing: that is a failure here, as is any other non-zero code.
    # tests/test_notebooks.py runs each tutorial in nbs/ top to bottom and keeps the executed copy.
    # Two test files at a time (a file's tests share its fixtures): most tests spend their time waiting on other
    # processes (ranks starting, timeouts running out), so one file at a time leaves a core idle.
    RANKSAFE_EXECUTED_NOTEBOOKS=$executed pytest -n 2 --dist loadfile "${@:2}"
    # The docs site, strict: a broken link or cross-reference fails the run (docstrings: tests/test_docstrings.py).
    # The tutorial pages show the outputs of the run above (docs/_ext/executed_notebooks.py), not a second run.
    RANKSAFE_EXECUTED_NOTEBOOKS=$executed NO_MKDOCS_2_WARNING=1 timeout 900 mkdocs build --strict -d "$site"  # not --quiet: it hides the warnings
    ;;
  compat)
    # The integration tests against the oldest and the newest lightning and fastai that pyproject.toml allows,
    # each in a venv of its own under .venv-compat/ (kept between runs). Not part of `test`: each venv takes
    # minutes to set up. `bash dev.sh compat lightning oldest` runs one of the four, `... fastai 2.8.10` a version.
    setup "$@"
    status=0
    for package in lightning fastai; do
      [[ -n ${2:-} && $2 != "$package" ]] && continue
      for which in ${3:-oldest newest}; do  # or one of them, or a version number
        venv=.venv-compat/$package-$which
        echo "== $package ($which) in $venv"
        version=$("$VENV/bin/python" requirements/compat.py "$venv" "$package" "$which" | tail -1)
        echo "== $version"
        if [[ $package == lightning ]]; then tests=(tests/test_*lightning*.py); else tests=(tests/test_*fastai*.py); fi
        if "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"; then
          echo "== PASS $version"
        else
          echo "== FAIL $version"; status=1
        fi
      done
    done
    exit $status ;;
  gpu)
    # No venv: .venv holds the CPU build of torch. The machine's own CUDA build runs the tests marked cuda (skipped
    # everywhere else) and the CUDA benchmarks; fastai, lightning and pytest must already be importable there.
    export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
    status=0
    "$PY" -m pytest -m cuda -p no:cacheprovider -o addopts="-ra" --timeout 300 $(grep -l "mark.cuda" tests/test_*.py) "${@:2}" || status=1
    "$PY" -m benchmarks.cuda_async || status=1
    "$PY" -m benchmarks.cuda_steps || status=1
    exit $status ;;
  *)
    echo "usage: bash dev.sh demo|test|compat|gpu [args]" >&2; exit 2 ;;
esac
