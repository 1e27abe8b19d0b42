# Sourced by the scripts: become root if needed, find cargo, go to the repository root.
if [ "$(id -u)" != 0 ]; then exec sudo -E "$0" "$@"; fi
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cd "$(dirname "$0")/.."
# Go (the CONNECT-IP interop tests build quic-go's connect-ip-go): its usual install place, when
# a root shell's PATH lacks it.
if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then export PATH="$PATH:/usr/local/go/bin"; fi
