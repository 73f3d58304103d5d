# Sourced by the tests' set-up scripts: `apt_install LABEL LOG PACKAGE...` installs Debian packages
# as root (or with passwordless sudo). Returns non-zero, with the reason in LOG, when it cannot.
apt_install() {
    local label="$1" log="$2"
    shift 2
    if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
        echo "$label: not installed (not root and no sudo)" | tee "$log"
        return 1
    fi
    local as_root=""
    [ "$(id -u)" != "0" ] && as_root="sudo -n"
    echo "$label: installing Debian's $* (log: $log)"
    $as_root apt-get update -qq >"$log" 2>&1 \
        && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq --no-install-recommends "$@" >>"$log" 2>&1
}
