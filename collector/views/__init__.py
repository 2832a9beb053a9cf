"""Views: what users read. The SQL guard, the query client, compare, report and its plots."""
