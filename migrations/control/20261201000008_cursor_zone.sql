-- The zone a `timestamp without time zone` cursor's values are written in, frozen with the
-- epoch (its cursors are instants read in that zone). NULL: a cursor with a zone, or an epoch
-- planned before zones were learned (read as UTC).
ALTER TABLE epochs ADD COLUMN cursor_zone text;
