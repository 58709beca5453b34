"""``python -m distcheck`` and ``torchrun ... -m distcheck``: see distcheck/cli.py."""
import os
import sys

if __name__ == "__main__":
    # First of all, before anything heavy is imported: a launcher (run, compare) takes the stop signals over, so that
    # SIGTERM at any moment, even 0.1 s after the start, ends in a report (distcheck/supervise/signals.py). A rank
    # decides that without importing supervisor code (tests/unit/test_layout.py).
    from distcheck.options import is_launcher

    if is_launcher(sys.argv[1:]):
        from distcheck.supervise.signals import install_early

        install_early(sys.argv[1:])
    # Under torchrun with a shared zygote named (DISTCHECK_ZYGOTE=SOCKET): the rank is forked from it and this
    # process stands in for it (distcheck/supervise/zygote.py, stand_in). Checked before anything heavy is imported.
    from distcheck.contract import env

    if os.environ.get(env.ZYGOTE, "0") not in ("", "0", "1") and "TORCHELASTIC_RUN_ID" in os.environ:
        from distcheck.supervise.zygote import stand_in

        code = stand_in(sys.argv[1:])
        if code is not None:
            sys.exit(code)
    from distcheck.cli import main

    sys.exit(main())
