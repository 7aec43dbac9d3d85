"""The compiler version: part of every QPC and of the farm's cache key."""

COMPILER_VERSION = "0.1.0"
