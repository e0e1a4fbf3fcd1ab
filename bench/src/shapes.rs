//! The tables the benchmark generates. Each has the columns the benchmark's checks read (`id`
//! the key, `updated_at` the cursor, `amount`, and `note`, NULL in a quarter of the rows), and
//! its own mix of the rest; the table is always `bench_items`.

use clap::ValueEnum;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Shape {
    /// uuid, about 200 bytes of jsonb object, numeric, short text.
    Items,
    /// An order: customer and status, a jsonb array of 1–6 line items, a nullable
    /// timestamptz, and a longer note.
    Orders,
}

impl Shape {
    pub(crate) fn create(self) -> &'static str {
        match self {
            Shape::Items => {
                "CREATE TABLE bench_items (
                    id bigint PRIMARY KEY,
                    uid uuid NOT NULL,
                    updated_at timestamptz(3) NOT NULL,
                    payload jsonb NOT NULL,
                    amount numeric(12,2) NOT NULL,
                    note text
                )"
            }
            Shape::Orders => {
                "CREATE TABLE bench_items (
                    id bigint PRIMARY KEY,
                    customer_id bigint NOT NULL,
                    status text NOT NULL,
                    updated_at timestamptz(3) NOT NULL,
                    lines jsonb NOT NULL,
                    amount numeric(12,2) NOT NULL,
                    note text,
                    shipped_at timestamptz
                )"
            }
        }
    }

    /// Inserts the rows `first..=last`; the cursor has 50 rows per millisecond in both.
    pub(crate) fn insert(self, first: i64, last: i64) -> String {
        match self {
            Shape::Items => format!(
                "INSERT INTO bench_items
                 SELECT g, md5(g::text)::uuid,
                        timestamptz '2026-01-01 00:00:00+00' + (g / 50) * interval '1 millisecond',
                        jsonb_build_object('user', 'user-' || g, 'plan', CASE WHEN g % 3 = 0 THEN 'pro' ELSE 'free' END,
                                           'tags', jsonb_build_array('a' || g % 10, 'b' || g % 7),
                                           'text', repeat('lorem ipsum ', 10)),
                        (g % 100000) / 100.0,
                        CASE WHEN g % 4 = 0 THEN NULL ELSE 'note ' || g END
                 FROM generate_series({first}, {last}) g"
            ),
            Shape::Orders => format!(
                "INSERT INTO bench_items
                 SELECT g, g % 50000, (ARRAY['new', 'paid', 'shipped', 'returned'])[1 + g % 4],
                        timestamptz '2026-01-01 00:00:00+00' + (g / 50) * interval '1 millisecond',
                        (SELECT jsonb_agg(jsonb_build_object('sku', 'sku-' || (g * 7 + i) % 10000,
                                                             'qty', 1 + (g + i) % 5,
                                                             'price', ((g + i) % 9000) / 100.0))
                           FROM generate_series(1, 1 + g % 6) i),
                        (g % 100000) / 100.0,
                        CASE WHEN g % 4 = 0 THEN NULL ELSE 'leave at the door, ring twice; order ' || g END,
                        CASE WHEN g % 4 >= 2 THEN timestamptz '2026-01-02 00:00:00+00' + (g % 1000) * interval '1 minute' END
                 FROM generate_series({first}, {last}) g"
            ),
        }
    }
}
