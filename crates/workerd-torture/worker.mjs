// The module workerd loads: instantiates the torture worker (the
// wasm-bindgen output scripts/build-worker writes into build/) and exports
// the Durable Object class and the front Worker's fetch handler.
import wasmModule from "./index_bg.wasm";
import { initSync, TortureObject, fetch as rustFetch } from "./index.js";

initSync({ module: wasmModule });

export { TortureObject };

export default {
  fetch(request, env, ctx) {
    return rustFetch(request, env, ctx);
  },
};
