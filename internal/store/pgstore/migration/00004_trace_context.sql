-- +goose Up
-- Trace context (SYSTEM §10): the W3C traceparent of the span that accepted
-- an execution, stored with the execution at accept and copied into each
-- dispatch record and the completion event, so that the dispatcher, every
-- attempt (retries included) and the router's delivery continue one trace.
-- NULL when tracing was off or the row predates this migration.

ALTER TABLE executions        ADD COLUMN trace_context text;
ALTER TABLE dispatch_records  ADD COLUMN trace_context text;
ALTER TABLE completion_events ADD COLUMN trace_context text;

-- +goose Down
ALTER TABLE completion_events DROP COLUMN trace_context;
ALTER TABLE dispatch_records  DROP COLUMN trace_context;
ALTER TABLE executions        DROP COLUMN trace_context;
