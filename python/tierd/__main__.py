"""python3 -m tierd status [--socket-dir DIR]: connects, and prints the device and each tier."""
import argparse
import sys

from . import Tier, TierdError, connect
from ._sizes import size_text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tierd")
    parser.add_argument("command", choices=["status"])
    parser.add_argument("--socket-dir", default=None,
                        help="the daemon's socket directory (else $TIERD_SOCKET_DIR, /run/tierd)")
    args = parser.parse_args(argv)
    try:
        with connect(args.socket_dir, "python -m tierd") as client:
            print(f"session {client.session_id}")
            try:
                device = client.device()
                print(f"device  {device['uuid']}{' (emulated)' if device['emulated'] else ''}, "
                      f"{size_text(device['memory_bytes'])}")
            except TierdError as e:
                if e.code_name != "NOT_FOUND":
                    raise
                print(f"device  none ({e.message})")  # a daemon without a device tier
            for tier in Tier:
                u = client.tier_usage(tier)
                if not u.configured:
                    print(f"{tier.name.lower():7} not configured")
                    continue
                print(f"{tier.name.lower():7} {size_text(u.used_bytes)} of "
                      f"{size_text(u.capacity_bytes)} used, largest free "
                      f"{size_text(u.largest_free_bytes)}")
    except TierdError as e:
        print(f"tierd: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
