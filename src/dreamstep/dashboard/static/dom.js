// What every dashboard page shares: the token of the address the dashboard printed (kept for this tab in
// sessionStorage, so the pages it links to can send it with their changes) and el(), which builds the DOM from
// text (never innerHTML with data). Loaded before each page's own script.
"use strict";

const TOKEN = (() => {
  const given = new URLSearchParams(location.search).get("token");
  if (given) { sessionStorage.setItem("dreamstep_token", given); }
  return given || sessionStorage.getItem("dreamstep_token") || "";
})();

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) { continue; }
    if (key === "class") { node.className = value; } else if (key === "text") { node.textContent = value; }
    else if (key.startsWith("on")) { node.addEventListener(key.slice(2), value); } else { node.setAttribute(key, value); }
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) { node.append(child instanceof Node ? child : String(child)); }
  }
  return node;
}
