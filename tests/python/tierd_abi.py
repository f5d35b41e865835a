"""The C ABI's constants, structures and signatures, from the tierd package (python/tierd/_abi.py).

Tests find the library through TIERD_CLIENT_LIB, set by CTest.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

from tierd._abi import (ACCESS_OVERWRITE, ACCESS_READ, ACCESS_WRITE, FAILED_PRECONDITION,  # noqa: E402,F401
                        INVALID_ARGUMENT, NOT_FOUND, OK, RESOURCE_EXHAUSTED, TIER_DEVICE, TIER_HOST,
                        TIER_NVME, BaseCreate, BaseInfo, Completion, SessionStats, TierUsage,
                        load_library)
