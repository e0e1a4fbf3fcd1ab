# Sourced by the demos: `verdict NAME DIR` compares DIR/source.tsv with DIR/target.tsv (one
# line per key, key first, sorted alike) and prints the per-key verdict; exits 1 on a
# difference.
verdict() {
  local name="$1" dir="$2" keys lost phantom differing
  keys=$(wc -l <"$dir/source.tsv")
  if diff -q "$dir/source.tsv" "$dir/target.tsv" >/dev/null; then
    echo "$name: PASS: $keys keys, target equals source per key (0 lost, 0 stale, 0 phantom)"
  else
    lost=$(comm -23 <(cut -f1 "$dir/source.tsv" | sort) <(cut -f1 "$dir/target.tsv" | sort) | wc -l)
    phantom=$(comm -13 <(cut -f1 "$dir/source.tsv" | sort) <(cut -f1 "$dir/target.tsv" | sort) | wc -l)
    differing=$(diff "$dir/source.tsv" "$dir/target.tsv" | grep -c '^<' || true)
    echo "$name: FAIL: $keys source keys; $lost lost, $phantom phantom, $differing rows differ (see $dir/*.tsv)"
    exit 1
  fi
}
