"""Stage 2, moving: samples into batches, batches into the on-disk spool, the spool to the collector over gRPC.
"""
