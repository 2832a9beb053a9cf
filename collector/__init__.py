"""The collector: gRPC ingest, the single DuckDB writer, schema migrations, analyzer, report, CLI."""
