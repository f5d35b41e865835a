#!/usr/bin/env bash
# Prints the path of the Python environment the tests, the demo and the benchmarks run in, after
# making it if it is not there yet: Debian's python3 with the packages of requirements.txt from
# PyPI. It lives outside the clone, under $TIERD_PYTHON_ENVS (default ~/.cache/tierd), named by
# the hash of requirements.txt and the interpreter's version, so a second run and a fresh clone
# on the same machine reuse it; a changed requirements file makes a new one beside it.
#
# The environment sees Debian's site packages (python3-grpcio, -protobuf, -yaml, which match the
# daemon's gRPC and Protobuf); what requirements.txt pins comes first. A half-made environment
# (an interrupted download) is made again; two runs at once wait for each other.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=/usr/bin/python3
requirements="$root/requirements.txt"
envs=${TIERD_PYTHON_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/tierd}
key=$( { cat "$requirements"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
env="$envs/python-$key"

mkdir -p "$envs"
exec 9>"$env.lock"
flock 9
if [[ ! -e "$env/.complete" ]]; then
  rm -rf "$env"
  echo "python-env: installing requirements.txt into $env (PyPI's torch is several GB; once)" >&2
  "$python" -m venv --system-site-packages "$env"
  "$env/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    -r "$requirements" >&2
  "$env/bin/python" -m pip freeze --local > "$env/requirements.installed"
  touch "$env/.complete"
fi
echo "$env"
