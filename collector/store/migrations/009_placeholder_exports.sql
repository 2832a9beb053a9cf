-- Placeholder for 009_exports (the lake branch); the integrator removes this file when that lands.
SELECT 1;
