// The module workerd loads: instantiates the wasm-bindgen output (built by
// scripts/build-worker into build/) and exports the benchmark's Durable
// Object class and the front Worker's fetch handler.
import wasmModule from "./index_bg.wasm";
import { initSync, BenchObject, fetch as rustFetch } from "./index.js";

initSync({ module: wasmModule });

export { BenchObject };

export default {
  fetch(request, env, ctx) {
    return rustFetch(request, env, ctx);
  },
};
