#!/usr/bin/env bash
# Installs the Debian packages that `make test` and the benchmarks use (the one list; .ci/run calls this).
# As root on Debian/Ubuntu: `sudo scripts/install-test-deps.sh`. tests/tools.py maps each tool to its package.
set -euo pipefail
PACKAGES=(
  make python3-venv gcc libc6-dev  # the venv and the NVML emulator (a C library)
  fio stress-ng                    # probe accuracy, noisy-neighbour tests
  virt-what systemd                # fingerprint, unit checks (systemd-analyze)
  prometheus                       # promtool and the scrape tests
  prometheus-node-exporter sysstat # the overhead benchmark's reference
  chromium                         # the report test
  openssl                          # TLS tests
  iperf3 iproute2                  # the namespace fabric testbed (ip netns, tc) and its accuracy benchmark
  mount e2fsprogs                  # losetup / mkfs.ext4 for the small-filesystem retention test
  openjdk-17-jre-headless          # Spark (the lake extra)
  slurmctld slurmd slurm-client munge  # the single-node Slurm cluster tests (job attribution)
)
if [ "${1:-}" = "--list" ]; then printf '%s\n' "${PACKAGES[@]}"; exit 0; fi
if ! command -v apt-get >/dev/null; then
  echo "install-test-deps: no apt-get here; install these packages by hand: ${PACKAGES[*]}" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-test-deps: needs root (apt-get install); run it as: sudo $0" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "install-test-deps: installed ${#PACKAGES[@]} Debian packages"
