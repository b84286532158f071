// Money is integer micro-USD everywhere; shown as dollars without losing the small amounts.
export function usd(micro) {
  if (micro === null || micro === undefined) return "—";
  const negative = micro < 0;
  const abs = Math.abs(Math.trunc(micro));
  const dollars = Math.trunc(abs / 1_000_000);
  let cents = String(abs % 1_000_000).padStart(6, "0").replace(/0+$/, "");
  if (cents.length < 2) cents = cents.padEnd(2, "0");
  return (negative ? "−$" : "$") + dollars.toLocaleString("en-US") + "." + cents;
}

export function when(epochSeconds) {
  if (!epochSeconds) return "never";
  return new Date(epochSeconds * 1000).toLocaleString(undefined, {
    year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
  });
}

export function ago(epochSeconds) {
  if (!epochSeconds) return "never";
  const seconds = Math.max(0, Math.round(Date.now() / 1000 - epochSeconds));
  if (seconds < 10) return "just now";
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return when(epochSeconds);
}

export function count(n) {
  return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US");
}
