-- PLACEHOLDER on branch p4c-mfu only: main gets 009_exports from the lake branch; the integrator removes this file.
SELECT 1;
