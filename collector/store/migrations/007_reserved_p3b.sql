-- Numbering placeholder so that 010_exports.sql applies on this branch (migrations run 1..N without gaps).
-- The integrator replaces it with the migration other branches number here.
SELECT 1;
