-- PLACEHOLDER on branch p4c-mfu only: main gets 010 retention from p3-retention; the integrator removes this file.
SELECT 1;
