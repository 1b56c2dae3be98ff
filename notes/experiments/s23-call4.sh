#!/usr/bin/env bash
# Session 23, call 4: call 3's checks again, on the final code (with the pool's retry avoiding
# lazy legacy fences).
exec bash "$(dirname "$0")/s23-call3.sh"
