// Runs named cases one after another and prints {name: {ok, value | error}} as one JSON line.
export async function run(cases, errorOf) {
  const results = {};
  for (const [name, call] of Object.entries(cases)) {
    const started = Date.now();
    try {
      results[name] = { ok: true, value: await call() };
    } catch (e) {
      results[name] = { ok: false, error: errorOf(e) };
    }
    results[name].ms = Date.now() - started;
  }
  process.stdout.write(JSON.stringify(results) + "\n");
}
