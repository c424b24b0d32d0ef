// Shows the Captions link in the dashboard's header when the server was started with --edit_captions.
"use strict";
window.addEventListener("DOMContentLoaded", async () => {
  const response = await fetch("/api/info", { credentials: "same-origin" });
  if (response.ok && (await response.json()).captions) { document.getElementById("nav-captions").hidden = false; }
});
