# Source on an offline GPU box (python3 with CUDA torch + transformers) inside the Gyre checkout:
#     source scripts/gpu/env.sh
# Installs the wheels of scripts/gpu/fetch_wheels.sh into /tmp/gyre-site and puts them and Gyre's
# packages on PYTHONPATH, so `gyre` (= python3 -m gyre.cli) and pytest work without pip access.
_gyre_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ ! -f /tmp/gyre-site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gyre-site "$_gyre_root"/.gpu-wheels/*.whl \
    && touch /tmp/gyre-site/.done
fi
export PYTHONPATH=/tmp/gyre-site:$_gyre_root/libs:$_gyre_root/services/inference:$_gyre_root/services/trainer:$_gyre_root/services/orchestrator${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
gyre() { python3 -m gyre.cli "$@"; }
export -f gyre
