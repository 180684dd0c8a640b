package timelinesvg

import (
	"bytes"
	"context"
	"fmt"
	"image"
	"image/png"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestBrowserRendersTimeline opens a rendered timeline in a real browser (Debian's headless Chromium, which
// scripts/setup.sh installs) and checks the screenshot: the picture's size, every stage's bar in its
// colour where the layout put it, and text in the title. It proves the SVG is one a browser draws, not
// only well-formed XML.
func TestBrowserRendersTimeline(t *testing.T) {
	if testing.Short() {
		t.Skip("SKIPPED in -short mode: starts a browser; `make test` runs it")
	}
	chromium, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("CI") == "" {
			t.Skip("SKIPPED LOUDLY: chromium is not installed (scripts/setup.sh installs it); with CI set this fails")
		}
		t.Fatalf("chromium is not installed and CI is set: run scripts/setup.sh (it installs Debian's chromium): %v", err)
	}
	f := demoFailure()
	svg := Render([]Failure{f})
	width, height := svgSize(t, svg)
	dir := t.TempDir()
	in, out := filepath.Join(dir, "timeline.svg"), filepath.Join(dir, "timeline.png")
	if err := os.WriteFile(in, svg, 0o600); err != nil {
		t.Fatal(err)
	}
	// The timeout is only a failure bound: the test waits for the browser to exit.
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, chromium, "--headless", "--no-sandbox", "--disable-gpu",
		"--user-data-dir="+filepath.Join(dir, "profile"), // its own profile: several tests may run browsers at once
		"--force-device-scale-factor=1", "--hide-scrollbars", "--no-first-run", "--disable-extensions",
		// Nothing to the network: on a host without one, Chromium's background requests (updates, sync,
		// Google's hosts) fail over and over, and in ci223 it wrote the screenshot and then did not exit
		// for a minute.
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
		"--screenshot="+out, fmt.Sprintf("--window-size=%d,%d", width, height), "file://"+in)
	cmd.Env = append(os.Environ(), "HOME="+dir) // nothing written to the user's home
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium: %v\n%s", err, logs.Bytes())
	}
	pf, err := os.Open(out)
	if err != nil {
		t.Fatalf("chromium wrote no screenshot: %v\n%s", err, logs.Bytes())
	}
	defer pf.Close()
	img, err := png.Decode(pf)
	if err != nil {
		t.Fatalf("the screenshot is not a PNG: %v", err)
	}
	if b := img.Bounds(); b.Dx() != width || b.Dy() != height {
		t.Fatalf("screenshot is %dx%d, want the picture's %dx%d", b.Dx(), b.Dy(), width, height)
	}
	// Every bar: most of its inside in its stage's colour.
	_, bars := layout(&f)
	for i, s := range f.Stages {
		bar := bars[i]
		top := rowTop(0, i) + barDY
		r := image.Rect(int(math.Ceil(bar.X))+1, int(math.Ceil(top))+2, int(math.Floor(bar.X+bar.W))-1, int(math.Floor(top+barH))-2)
		if r.Dx() < 1 {
			r.Max.X = r.Min.X + 1
		}
		want := hexColour(t, Colour(s))
		match, all := countPixels(img, r, func(c [3]int) bool { return near3(c, want, 24) })
		if match*10 < all*8 {
			t.Errorf("stage %q: %d of %d pixels in its bar %v have its colour %v", s.Name, match, all, r, want)
		}
	}
	// The title: text drawn in a dark colour (a browser without a usable font draws nothing there).
	dark, _ := countPixels(img, image.Rect(labelX, 8, labelX+300, 32), func(c [3]int) bool { return c[0]+c[1]+c[2] < 3*100 })
	if dark < 150 {
		t.Errorf("only %d dark pixels in the title: the text was not drawn", dark)
	}
	// The bottom right corner is empty: the picture is drawn where the layout says, not everywhere.
	stray, _ := countPixels(img, image.Rect(width-40, height-10, width, height), func(c [3]int) bool { return c != [3]int{255, 255, 255} })
	if stray > 0 {
		t.Errorf("%d non-background pixels in the empty bottom right corner", stray)
	}
}

// svgSize reads the width and height attributes Render writes.
func svgSize(t *testing.T, svg []byte) (int, int) {
	t.Helper()
	var w, h int
	if _, err := fmt.Sscanf(string(svg), `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d"`, &w, &h); err != nil {
		t.Fatalf("no size in %.200s: %v", svg, err)
	}
	return w, h
}

func hexColour(t *testing.T, s string) [3]int {
	t.Helper()
	v, err := strconv.ParseUint(s[1:], 16, 32)
	if err != nil || len(s) != 7 {
		t.Fatalf("colour %q: %v", s, err)
	}
	return [3]int{int(v >> 16 & 0xff), int(v >> 8 & 0xff), int(v & 0xff)}
}

// countPixels is how many pixels of r satisfy ok, and how many r holds.
func countPixels(img image.Image, r image.Rectangle, ok func([3]int) bool) (match, all int) {
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			cr, cg, cb, _ := img.At(x, y).RGBA()
			if ok([3]int{int(cr >> 8), int(cg >> 8), int(cb >> 8)}) {
				match++
			}
			all++
		}
	}
	return match, all
}

func near3(a, b [3]int, tol int) bool {
	for i := range a {
		if d := a[i] - b[i]; d > tol || d < -tol {
			return false
		}
	}
	return true
}
