package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPKIIssueLongOperatorName: an operator name `pki issue --operator` accepts gets its certificate
// written; a name it cannot write is refused before anything is signed or created.
func TestPKIIssueLongOperatorName(t *testing.T) {
	dir := pkiCluster(t)
	name := strings.Repeat("a", 60) // a valid member name (at most 64 bytes)
	out, code, err := runFtctl(t, "pki", "issue", "--dir", dir, "--operator", name)
	if code == 0 {
		return
	}
	if _, serr := os.Stat(filepath.Join(dir, "operator-"+name)); serr == nil {
		t.Errorf("pki issue --operator %s failed (exit %d: %v) after creating its directory\n%s", name, code, err, out)
	}
	t.Logf("refused: %v", err)
}
