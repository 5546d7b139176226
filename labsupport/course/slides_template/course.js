// Start reveal.js on the slides nbconvert wrote; speaker notes on "s".
Reveal.initialize({
  controls: true,
  progress: true,
  history: true,
  hash: true,
  slideNumber: "c/t",
  transition: "none",
  width: 1280,
  height: 800,
  plugins: [RevealNotes]
});
