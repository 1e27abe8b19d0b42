# Sourced by the scripts: become root if needed, find cargo, go to the repository root.
if [ "$(id -u)" != 0 ]; then exec sudo -E "$0" "$@"; fi
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cd "$(dirname "$0")/.."
