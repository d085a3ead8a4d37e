#!/usr/bin/env bash
# Installs the Debian packages spokefs needs when they are missing: libfuse3 (the mount and
# pyfuse3's build), pkg-config (pyfuse3's build), chromium (the browser tests/test_ui.py drives
# through playwright: Debian's, so playwright downloads no browser of its own). rclone is a
# benchmark peer: installed when SPOKEFS_PEERS=1. Runs as root or through sudo; does nothing
# when all is present. Also checks that cargo (Rust) is on the PATH: the install builds the
# native core (native/, spokefs._native) with it. It does not install Rust: that is rustup's.
set -euo pipefail
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo (Rust) is not on the PATH; spokefs's native core (native/) is built with it." >&2
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    echo "  rustup installed it in ~/.cargo/bin: run '. \"\$HOME/.cargo/env\"', then try again." >&2
  else
    echo "  Install it with rustup (https://rustup.rs):" >&2
    echo "    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y" >&2
    echo "  then run '. \"\$HOME/.cargo/env\"' and try again." >&2
  fi
  exit 1
fi
need=()
dpkg -s fuse3 >/dev/null 2>&1 || need+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need+=(libfuse3-dev)
dpkg -s pkg-config >/dev/null 2>&1 || need+=(pkg-config)
dpkg -s chromium >/dev/null 2>&1 || need+=(chromium)
if [ "${SPOKEFS_PEERS:-0}" = 1 ]; then
  dpkg -s rclone >/dev/null 2>&1 || need+=(rclone)
fi
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing Debian packages: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
