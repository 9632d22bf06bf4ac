#!/bin/bash
# Runs an example binary; the examples check their own results.
exec "$@"
