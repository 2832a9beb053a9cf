"""`python -m gpuagent.probes NAME --json [--param k=v ...]`: run one probe in this process.

With --json it prints exactly one JSON object on stdout and exits 0 whatever the probe's status, so the
runner always has something to read. Anything the probe (or a library, or a worker process) prints to
stdout is redirected to stderr while it runs, so that object is the only thing on stdout.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback


class Terminated(BaseException):
    """SIGTERM from the runner at its timeout: unwinds so that probes' finally blocks clean up."""


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise Terminated(f"terminated by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuagent.probes")
    ap.add_argument("name")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--param", action="append", default=[], metavar="K=V")
    args = ap.parse_args(argv)

    # Keep the real stdout for the result only.
    real_stdout = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, _on_sigterm)

    from gpuagent.probes import registry
    from gpuagent.probes.result import ProbeResult

    started = time.time_ns()
    params: dict = {}
    try:
        params = registry.parse_params(args.name, args.param)
        result = registry.run_function(args.name)(params)
        if not isinstance(result, ProbeResult):
            raise TypeError(f"probe {args.name} returned {type(result).__name__}, not ProbeResult")
    except registry.ParamError as exc:
        result = ProbeResult(args.name, "failed", str(exc), params={"argv": " ".join(args.param)})
    except Terminated as exc:
        result = ProbeResult(args.name, "failed", str(exc), params=params)
    except Exception as exc:  # a probe reports, it does not raise: turn a crash into a failed result
        traceback.print_exc(file=sys.stderr)
        result = ProbeResult(args.name, "failed", f"{type(exc).__name__}: {exc}", params=params)
    result.params = result.params or params
    result.started_ns = result.started_ns or started
    result.ended_ns = result.ended_ns or time.time_ns()

    if args.json:
        real_stdout.write(result.to_json() + "\n")
    else:
        from gpuagent.probes.format import format_result
        real_stdout.write(format_result(result.to_dict()) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
