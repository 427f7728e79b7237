#!/usr/bin/env bash
# Run tests/test_hub.py against several huggingface_hub releases, each in a throwaway venv.
#
#   tests/hub_versions.sh                 # the default matrix below
#   tests/hub_versions.sh 1.12.0 2.1.1    # chosen versions
#   PYTHON=python3.12 tests/hub_versions.sh
#
# The hub changed its HTTP client twice (requests below 1.0, httpx in 1.x, httpx2 from 2.0) and
# its error classes with it; minfer/hub.py maps all of them. The defaults are the oldest release
# minfer supports, the first and last of each major line after it (1.0.0 and 2.0.0 are where the
# client changed) and the newest. Needs PyPI access. The venvs live in a temporary folder removed
# at the end; building minfer leaves setuptools' build/ and minfer.egg-info/ (git-ignored) in the
# checkout. Exit status: 0 when every version passes.
set -euo pipefail

VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
    VERSIONS=(0.25.2 0.36.2 1.0.0 1.33.0 2.0.0 2.4.0)
fi
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/minfer-hub-versions.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

declare -a RESULTS
status=0
for version in "${VERSIONS[@]}"; do
    echo "=== huggingface_hub $version"
    venv="$WORK/hub-$version"
    "$PYTHON" -m venv "$venv"
    # One install so that pip resolves minfer's pin and the requested hub together: a version
    # outside minfer's range fails here rather than silently testing another one.
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check \
            "$ROOT[test]" "huggingface_hub==$version"; then
        RESULTS+=("$version: install failed")
        status=1
        continue
    fi
    # From the temp folder, so that `import minfer` is the installed copy, not the checkout's.
    log="$WORK/hub-$version.log"
    if (cd "$WORK" && "$venv/bin/python" -m pytest "$ROOT/tests/test_hub.py" -rs \
            -p no:cacheprovider) >"$log" 2>&1; then
        RESULTS+=("$version: $(tail -n 1 "$log")")
    else
        RESULTS+=("$version: FAILED: $(tail -n 1 "$log")")
        status=1
    fi
    cat "$log"
done

echo
echo "=== summary (huggingface_hub version: pytest tests/test_hub.py)"
printf '%s\n' "${RESULTS[@]}"
exit $status
