"""Ingest: the gRPC server, authentication, node identity claims and batch validation."""
