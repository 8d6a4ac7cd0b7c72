// Runs a wasm32-wasip1 program (a `cargo test --target wasm32-wasip1` test binary) under
// Node.js's built-in WASI, as cargo's runner:
//   CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings tools/wasi-run.mjs"
// The arguments after the module are the program's (libtest's filters and flags); the exit
// code is the program's. Nothing of the file system is opened to it: the core's tests need none.
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import { argv, env, exit } from "node:process";

const [module, ...args] = argv.slice(2);
if (!module) {
  console.error("usage: node tools/wasi-run.mjs PROGRAM.wasm [ARGS...]");
  exit(2);
}
const wasi = new WASI({ version: "preview1", args: [module, ...args], env, returnOnExit: true });
const instance = await WebAssembly.instantiate(
  await WebAssembly.compile(await readFile(module)),
  wasi.getImportObject(),
);
exit(wasi.start(instance));
