"""Per-rank step telemetry: records, aggregation into reports, stragglers, traces, plots."""
