//go:build linux

package ebpfprobes

import (
	"go/ast"
	"go/parser"
	"go/token"
	"testing"
)

// TestCloseObjectsClosesEveryObject: each loader's closeObjects closes every program and map its
// *Loaded struct holds. A map left out stays in the kernel after Close, its file descriptor held until
// the garbage collector finds the loader unreachable (recvorder's pessimistic map was). It reads the
// sources: the objects cannot be made without loading BPF.
func TestCloseObjectsClosesEveryObject(t *testing.T) {
	for _, c := range []struct{ file, loaded, recv string }{
		{"tcplogger.go", "tcplogLoaded", "TCPLogger"},
		{"recvtap.go", "tcprecvLoaded", "RecvTap"},
		{"recvorder.go", "recvorderLoaded", "RecvOrder"},
	} {
		f, err := parser.ParseFile(token.NewFileSet(), c.file, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		var want []string // the fields holding a program or a map
		closed := map[string]bool{}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.TypeSpec:
				st, ok := n.Type.(*ast.StructType)
				if !ok || n.Name.Name != c.loaded {
					return true
				}
				for _, fld := range st.Fields.List {
					star, ok := fld.Type.(*ast.StarExpr)
					if !ok {
						continue
					}
					if sel, ok := star.X.(*ast.SelectorExpr); ok && (sel.Sel.Name == "Map" || sel.Sel.Name == "Program") {
						for _, name := range fld.Names {
							want = append(want, name.Name)
						}
					}
				}
			case *ast.FuncDecl:
				if n.Name.Name != "closeObjects" || n.Recv == nil {
					return true
				}
				if star, ok := n.Recv.List[0].Type.(*ast.StarExpr); !ok || star.X.(*ast.Ident).Name != c.recv {
					return true
				}
				ast.Inspect(n.Body, func(n ast.Node) bool {
					// x.objs.Name
					if sel, ok := n.(*ast.SelectorExpr); ok {
						if inner, ok := sel.X.(*ast.SelectorExpr); ok && inner.Sel.Name == "objs" {
							closed[sel.Sel.Name] = true
						}
					}
					return true
				})
				return false
			}
			return true
		})
		if len(want) == 0 || len(closed) == 0 {
			t.Fatalf("%s: found %d objects in %s and %d closed by (*%s).closeObjects: the test no longer matches the source", c.file, len(want), c.loaded, len(closed), c.recv)
		}
		for _, name := range want {
			if !closed[name] {
				t.Errorf("%s: (*%s).closeObjects does not close %s.%s: it outlives Close", c.file, c.recv, c.loaded, name)
			}
		}
	}
}
