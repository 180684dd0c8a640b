package labtest

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/lab"
)

// DropFrom makes host drop every packet that arrives from addr (what CRIU's network lock does to a dumped
// job's connections), until the returned function or the test's end removes the rule.
func DropFrom(t testing.TB, l *lab.Lab, host string, addr netip.Addr) func() {
	t.Helper()
	chains := fmt.Sprintf("\tchain in {\n\t\ttype filter hook input priority 0; policy accept;\n\t\tip saddr %s drop\n\t}", addr)
	undo, err := l.Filter(host, "ftkit_test_drop", chains)
	if err != nil {
		t.Fatal(err)
	}
	remove := func() {
		if err := undo(); err != nil {
			t.Errorf("remove the drop on %s: %v", host, err)
		}
	}
	t.Cleanup(remove)
	return remove
}
