-- gpuagent collector schema, version 6: unambiguous label text.
-- From this version a backslash, comma or equals sign inside a label key or value (and inside a probe
-- parameter, in params_key) is escaped with a backslash, so {a: "1,b=2"} and {a: "1", b: "2"} are stored
-- as different texts. Rows written before it joined k=v pairs without escaping: a backslash in them is
-- doubled here, which makes every row that had no comma or equals sign inside a key or value read exactly as
-- a new row would. A row whose value itself held ',' or '=' cannot be told apart from two labels any more
-- and is left as it was.
UPDATE samples SET labels = replace(labels, '\', '\\') WHERE contains(labels, '\');
UPDATE samples_1m SET labels = replace(labels, '\', '\\') WHERE contains(labels, '\');
UPDATE probe_results SET params_key = replace(params_key, '\', '\\') WHERE contains(params_key, '\');
UPDATE probe_metrics SET params_key = replace(params_key, '\', '\\') WHERE contains(params_key, '\');
UPDATE fleet_baselines SET params_key = replace(params_key, '\', '\\') WHERE contains(params_key, '\');
