-- +goose Up
-- Release steps (SYSTEM §6: cardinality, live session, Object Publish). The
-- await unit of a release step belongs to the execution, not to one
-- attempt: its id is derived from (execution, step) alone, a retried
-- attempt adopts it, and its interactions survive the retry, so a replay
-- feeds completed items from their stored completions and never opens a
-- second interaction for an item.
ALTER TABLE await_units
    ADD COLUMN release_step boolean NOT NULL DEFAULT false,
    -- Number of items the source held, set when the unit completes.
    ADD COLUMN item_count   integer CHECK (item_count >= 0);

-- +goose Down
ALTER TABLE await_units DROP COLUMN release_step, DROP COLUMN item_count;
