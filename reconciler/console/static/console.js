// Outbox console: progressive enhancement only; every page works without it.
// A form marked data-once disables its buttons once submitted, so a double click
// sends one request. (The server does not rely on this: a repeated action id
// replays the recorded result instead of acting twice.)
"use strict";
document.addEventListener("submit", function (event) {
  var form = event.target;
  if (!(form instanceof HTMLFormElement) || !form.hasAttribute("data-once")) return;
  if (form.dataset.sent === "yes") { event.preventDefault(); return; }
  form.dataset.sent = "yes";
  window.setTimeout(function () {
    form.querySelectorAll("button[type=submit]").forEach(function (b) { b.disabled = true; });
  }, 0);
});
// Coming back to a page from the history cache: let the form be used again.
window.addEventListener("pageshow", function () {
  document.querySelectorAll("form[data-once]").forEach(function (form) {
    delete form.dataset.sent;
    form.querySelectorAll("button[type=submit]").forEach(function (b) { b.disabled = false; });
  });
});
// The page's alert is focused on load (the autofocus attribute does it; this
// covers a browser that ignores autofocus on a non-form element).
document.addEventListener("DOMContentLoaded", function () {
  var alert = document.querySelector("[data-autofocus]");
  if (alert && (document.activeElement === document.body || document.activeElement === null)) {
    alert.focus();
  }
});
